"""Where Ember runs: the embedded cluster or a joined one, KubeRay manifests, capacity plans."""
