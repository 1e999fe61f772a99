"""Weight-sync transports (the data plane of each backend); asyncrl/trainer/weight_sync.py runs the rounds."""
