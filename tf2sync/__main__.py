"""`python -m tf2sync`: the launcher (same as the `tf2sync` command)."""

from tf2sync._src.launcher.launch import run

if __name__ == "__main__":
    run()
