"""The command line's commands; ``diffusiond/cli.py`` holds the parser and the dispatch.

    generate.py   generate: one job, its progress, its files (and Ctrl-C or a signal cancels it)
    follow.py     generate following its job's events, through a daemon that restarts meanwhile
    argtypes.py   the flags' argparse types: sizes, whole and finite numbers, --lora, --control, job ids
    progress.py   the progress line on a terminal, and a line now and then elsewhere
    preview.py    the picture forming, drawn in terminals that show images
    admin.py      status, models, history, cancel, sleep, wake, web-url
    residency.py  ps, load, unload: where each model is, and moving one by hand
    upscale.py    generate's --upscale and --hires, read into the request's fields

``diffusiond fit`` is no client of a daemon: cli.py dispatches it to daemon/residency/fit_command.py.

The exit codes are the contract in docs/api.md, because scripts branch on them.
"""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141  # 128 + SIGINT, 128 + SIGPIPE, as a shell reports them
