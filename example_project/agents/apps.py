from django.apps import AppConfig


class AgentsConfig(AppConfig):
    """Example tasks: questions, summaries and a research agent."""

    name = "agents"
    verbose_name = "Example agents"
