"""The sample runner, in one room: how a batch of samples runs through a stage list.

``pipeline`` (the :class:`Pipeline`: batches, streams), ``sample_runner`` (one sample's run:
the one place a stage's ending becomes a status), ``producer`` (the owned sample tasks),
``context`` (what a stage is and sees),
``stage`` (how one stage runs, with its record and the deadline checks at its boundaries),
``outcome`` (the end states), ``deadline`` (shared deadline timers), ``cleanup`` (stage
cleanups, once each), ``slice`` (loop time slices), ``stream`` (streams, groups, dynamic
sampling), ``fill`` (the trainer view of an ended item) and ``heartbeat`` (the progress log
lines of a running batch). Private: users import from :mod:`pipeline`.
"""
