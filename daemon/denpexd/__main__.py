from denpexd.cli import main

raise SystemExit(main())
