"""Default settings that several layers share (the loader, the sidecar, its CLI and config
file, the doctor), kept in one place so that they cannot drift apart."""

SHM_DIR = "/dev/shm"  # where a sidecar puts its shared-memory ring
SLOTS = 4  # slots of a sidecar's ring: how far it may run ahead of the trainer
CHUNK_RECORDS = 512  # records of one host computed per call, so that per-call costs are shared
