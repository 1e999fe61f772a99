"""The 0.1.0 name of the built-in server's entry point, kept so that a run directory's commands/server.sh written
by 0.1.0 still starts: ``python -m asyncrl.server`` runs ``python -m asyncrl.engine``. The code that was here is in
asyncrl/engine/ (the built-in server), asyncrl/serving/ (launching and checking servers) and asyncrl/weights/."""
