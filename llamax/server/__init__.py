"""llamax's OpenAI-compatible server (``pip install "llamax[server]"``,
``python -m llamax serve MODEL.gguf``).  See README, "Serve"."""
