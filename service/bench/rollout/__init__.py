"""``visionserve bench rollout``: candidate versions disagreeing by a known amount (:mod:`.candidates`), the
servers and their rollout route (:mod:`.traffic`), the three runs (:mod:`.scenarios`), the report (:mod:`.report`);
:mod:`.run` drives them."""
