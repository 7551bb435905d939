from app.dispatcher.loop import main

if __name__ == "__main__":
    main()
