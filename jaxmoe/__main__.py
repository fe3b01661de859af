from jaxmoe.cli import main

raise SystemExit(main())
