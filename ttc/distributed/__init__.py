"""Training on a Ray cluster (pipeline.py and train.py --engine ray): the driver (driver.py)
connects with ttc/serving/cluster.py's helpers, ships the DSPy program's student and its
trainer (a classifier's WeightTrainer, a segmenter's or a detector's ImageTrainer) to Ray Train
workers and hands back the same TrainedModel a local run does; each worker (worker.py) runs
ttc/nets's epoch loop (EpochRunner, ImageRunner) on its DistributedDataParallel
network, rank 0 scoring validation with dspy.Evaluate and writing a checkpoint each epoch;
launch.py holds what the driver's runs share. A candidate search runs its candidates as
parallel Ray Tune trials (search.py), each the same epoch loop in one process, and the DSPy
side picks the winner as a local search does (CandidateSearch.choose).
Ray is imported only here and in ttc/serving."""
