"""``python -m ember.cli`` runs the ``ember`` command."""

from ember.cli import main

raise SystemExit(main())
