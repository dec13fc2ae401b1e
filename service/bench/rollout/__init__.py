"""``visionserve bench rollout``: candidate versions disagreeing by a known amount (:mod:`.candidates`), the servers,
their rollout route and the three runs (:mod:`.scenarios`); :mod:`.run` drives them and reports."""
