"""Small helpers with vLLM's module paths (`tidepool.utils.argparse_utils`)."""
