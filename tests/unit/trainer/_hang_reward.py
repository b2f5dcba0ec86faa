"""A reward function for the reward-worker metrics test, light to import in a worker process."""
import os
import time


def hang_first(prompts, responses):
    """Scores 1 per response; the very first call of the run (no marker file in $HANG_MARKER_DIR yet) hangs."""
    marker = os.path.join(os.environ["HANG_MARKER_DIR"], "hung")
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(60)
    return [1.0] * len(responses)


def ones(prompts, responses):
    """Scores 1 per response at once."""
    return [1.0] * len(responses)
