"""Stand-ins for what the tests do not run for real: servers, engines, tokenizers."""
