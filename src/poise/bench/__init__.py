"""poise bench: load and measurement for any OpenAI-compatible endpoint."""
