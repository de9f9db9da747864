"""Training on a Ray cluster (pipeline.py and train.py --engine ray): the driver (driver.py)
connects with ttc/serving/cluster.py's helpers, ships the DSPy program's student and its
WeightTrainer to Ray Train workers and hands back the same TrainedModel a local run does; each
worker (worker.py) runs ttc/nets/program.py's EpochRunner on its DistributedDataParallel
network, rank 0 scoring validation with dspy.Evaluate and writing a checkpoint each epoch.
Ray is imported only here and in ttc/serving."""
