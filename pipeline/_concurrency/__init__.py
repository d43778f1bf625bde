"""The concurrency kit the runner, stages, judgers and the proxy share: cancellation told
apart and contained, owned concurrent work, shielded and bounded cleanups, abandoned tasks
(``cancel``); FIFO waiting lines and slots (``slots``); how user callables are checked and
called (``callables``). Private."""
