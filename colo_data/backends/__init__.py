"""Transports behind one `Backend` protocol: in process, sidecar processes, Pathways colocated Python."""
