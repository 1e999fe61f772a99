"""``python -m asyncrl.server``, the 0.1.0 entry point a run's commands/server.sh may hold, runs the built-in server."""

import asyncrl.engine.__main__ as engine_main
import asyncrl.server.__main__ as server_main


def test_the_old_entry_point_runs_the_engines_main():
    assert server_main.main is engine_main.main
