"""What a developer writes against: the decorator, options, apps, batching, pipelines."""
