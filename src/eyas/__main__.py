from eyas.cli import run

run()
