"""Tools built on the library: things a person runs, not the connector."""
