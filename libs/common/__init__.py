"""Code every service shares: wire schemas, subjects, NATS plumbing, logging, config."""
