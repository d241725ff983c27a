"""Default settings that several layers share (the loader, the sidecar, its CLI and config
file, the doctor), kept in one place so that they cannot drift apart."""

SHM_DIR = "/dev/shm"  # where a sidecar puts its shared-memory ring
SLOTS = 4  # slots of a sidecar's ring: how far it may run ahead of the trainer
# rows a partitioned packed pipeline's partition plans at once, at most (the whole batch's when
# fewer): a plan's fill grows with its rows (best fit on the demo corpus, rows of 512 tokens:
# 95.8% over 16 rows, 97.8% over 64, 98.8% over 256, 99.0% over 512)
PACK_PLAN_ROWS = 256
# The partitions of an endless packed or filtered pipeline that names none
# (`colo_data.pipeline.native.default_partitions`): PARTITIONS up to batches of PARTITIONS *
# PARTITION_ROWS rows, a partition per PARTITION_ROWS rows above. A host computes its own
# partitions (1/H of the work) for up to that many hosts; at one host its packing plans
# hold 16 batches' rows (PARTITIONS * min(B, PACK_PLAN_ROWS) rows up to B = 256).
PARTITIONS = 16
PARTITION_ROWS = 16
# The trainer's input wait that the worker policy counts workers for, a share of the time
# (`COLO_DATA_INPUT_WAIT`): an accelerator's time costs far more than the CPUs that spare it.
INPUT_WAIT = 0.005
CHUNK_RECORDS = 512  # records of one host computed per call, at most, so that per-call costs are shared
LOCAL_SIDECAR_DIR_PREFIX = "colo-data-sidecar-"  # a trainer's own sidecar's socket directory, in the temp dir
# A sidecar that works (opens a session, computes a batch) sends a heartbeat this often when
# it has nothing else to send; a trainer that hears nothing for `cd.Sidecar(timeout=...)`
# (SIDECAR_TIMEOUT_S by default) while it waits takes the sidecar for frozen.
HEARTBEAT_S = 1.0
SIDECAR_TIMEOUT_S = 20.0
# Object storage (ArrowSource): row-group reads in flight per reading process (a request
# costs tens of milliseconds before its first byte), decode threads beside them, retries
# of a transient failure, spans of records read ahead, and cache_dir's default size.
IO_CONCURRENCY = 32
DECODE_THREADS = 2
READ_RETRIES = 5
REMOTE_LOOKAHEAD = 4
CACHE_DIR_BYTES = 16 * 2**30
