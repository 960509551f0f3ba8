"""The synchronisation protocol over several parameter servers."""
