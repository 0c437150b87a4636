"""Who may talk to whom: TLS for every listener and channel, and the bearer-token credentials file."""
