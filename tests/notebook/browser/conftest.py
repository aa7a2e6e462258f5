"""tests/notebook/browser: the fixture notebook under notebook/ is opened by the browser test, not
collected as a test itself (e.g. by nbval)."""

collect_ignore_glob = ["*.ipynb"]
