"""Forks a child (as DataLoader workers are forked) and stops it with SIGTERM, as
multiprocessing's terminate() does; prints how the child ended."""
import os
import signal
import time

pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
time.sleep(0.5)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
if os.WIFSIGNALED(status):
    print("child killed by signal", os.WTERMSIG(status))
else:
    print("child exited with", os.WEXITSTATUS(status))
