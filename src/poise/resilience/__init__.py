"""Pure stability policies with an injected clock; no I/O, no imports from the rest of poise."""
