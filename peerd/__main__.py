from peerd.commands.cli import main

raise SystemExit(main())
