"""The run plan: ``run_plan`` is the frozen value the processes of a run receive (the validated config and the
decisions derived from it once); ``assemble`` builds it after composition, above the trainer and the servers."""
