"""`python -m kvhint_client.cli ...` runs the kvhint command line."""

from . import main

raise SystemExit(main())
