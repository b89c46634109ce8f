from fusionscope.cli import main

main()
