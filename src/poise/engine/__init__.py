"""One model replica: scheduling, paged KV cache, model execution. Knows nothing of HTTP."""
