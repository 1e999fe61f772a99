"""The run plan's decisions: ``assemble`` checks the composed config and builds the frozen RunPlan (asyncrl/run_plan.py,
written as plan.json by asyncrl/plan_file.py) with the rules of ``decide``, above the trainer and the servers, which
only read the plan."""
