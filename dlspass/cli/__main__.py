from dlspass.cli.commands import main

raise SystemExit(main())
