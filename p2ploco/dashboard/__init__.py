"""The dashboard: a web page on a node's status port (``GET /``) that draws the run as it trains, and the JSON
documents it reads (``documents.py``); ``p2ploco dashboard --from HOST:PORT`` serves the same page from a laptop,
reading a remote node's documents (``relay.py``)."""
