"""The example app: tasks that call an LLM provider the way real agent code does."""
