"""`radixserve plan`: KV-cache capacity from a model's config, sized as the server sizes it."""
