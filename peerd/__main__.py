from peerd.cli import main

raise SystemExit(main())
