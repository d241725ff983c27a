"""Operations tools: config files, Kubernetes manifests, bench, verify, the demo corpus, pinned versions."""
