"""Making model directories locally, since nothing may be downloaded."""
