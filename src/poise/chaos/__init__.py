"""``poise chaos``: steady load, one fault at a known time, and what the clients saw."""
