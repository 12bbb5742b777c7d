"""SneppX Kubernetes operator: manages ElasticTrainingJob resources (kopf)."""
