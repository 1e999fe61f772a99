"""The trainer's side of the generation servers: their command lines (built-in and vLLM), launching and watching
them, handles and groups of replicas, and the startup checks. The built-in server itself is asyncrl/engine/."""
