"""python -m attnserve_server: the attnserve command line."""

from attnserve_server.cli import main

raise SystemExit(main())
