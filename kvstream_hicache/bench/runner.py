"""stub"""
def add_arguments(p): pass
def run_cli(args): return 0
