"""A ``custom_task_module`` for tests/python/test_yarn_run.py (run with
``python -m yarn_custom_task`` in every container instead of ember.yarn.task).

The chief takes part as usual through ``ember.yarn.task.run_node``; the worker
dies before it ever registers (exit status 3), as a container whose Python
cannot even start the task would."""

import os
import sys

from ember.yarn import task

if __name__ == "__main__":
    if os.environ["EMBER_YARN_TASK"].startswith("worker"):
        print("custom task module: worker exits before registering", file=sys.stderr,
              flush=True)
        os._exit(3)
    code = task.run_node(lambda ctx: {"custom": True, "role": ctx.job_name},
                         reservation_timeout=120)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
