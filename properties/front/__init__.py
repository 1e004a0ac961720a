"""The front-end: which cells a run has (plan), the session ``splitgrad verify`` and the pytest
plugin share, hypothesis campaigns over a cell, the second worker process, expected failures."""
