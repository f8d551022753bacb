from diffusiond.cli import main

raise SystemExit(main())
