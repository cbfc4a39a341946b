"""The training heartbeat's CloudWatch metrics, as pipeline_steps/heartbeat.py emits them (embedded
metric format: https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format.html).
"""

# Heartbeat contract with pipeline_steps/heartbeat.py (EMF in the train step's logs): namespace,
# metric names and the dimension sets [["Stage"], ["Stage", "RunId"]]. The stall alarm and the
# per-run dashboard graphs use the per-run set. (Duplicated, not imported: the stacks must not
# import the training package.)
HEARTBEAT_NAMESPACE = "TrainiumEmbeddings"
HEARTBEAT_STEP_METRIC = "TrainStep"  # the global step: progress, one datapoint per heartbeat
HEARTBEAT_LOSS_METRIC = "TrainLoss"
HEARTBEAT_THROUGHPUT_METRIC = "TokensPerSecond"
HEARTBEAT_STAGE_DIMENSION = "Stage"
HEARTBEAT_RUN_DIMENSION = "RunId"
HEARTBEAT_RUN_DIMENSIONS = (HEARTBEAT_STAGE_DIMENSION, HEARTBEAT_RUN_DIMENSION)
